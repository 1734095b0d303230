"""The model a rank holds: the transformer, its attention kernels, fused norm and SwiGLU, the loss head."""
