"""Kubelet device plugin for `aliyun.com/gpu-mem`, compatible with Alibaba gpushare."""
