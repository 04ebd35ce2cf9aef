"""cgpu_km: GPU sharing for containers (memory limits and compute shares)."""

__version__ = "0.1.0"
