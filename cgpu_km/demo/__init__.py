"""`make demo`: the whole system on a simulated GPU (`python -m cgpu_km.demo`), with a
Docker engine of its own (`dockerd`) running an image built here (`image`)."""
