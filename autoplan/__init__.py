"""autoplan: find the fastest FSDP2 sharding plan that fits a per-device memory budget."""

__version__ = "0.1.0"
