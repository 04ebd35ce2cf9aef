"""cgpu-fuse: the control tree served with FUSE."""
