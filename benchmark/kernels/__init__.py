"""Our Triton kernels alone: timings and resource use against their references."""
