"""A directory hvdplusrun prepends to the workers' PYTHONPATH so that `import horovod.X` loads hvdplus.X."""
