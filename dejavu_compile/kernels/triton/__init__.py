"""Triton backend of the sparse ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``): ``mlp.py`` holds
the kernels and launchers. Imported on first CUDA use only: triton reads ``TRITON_INTERPRET`` when its
kernels are decorated."""
