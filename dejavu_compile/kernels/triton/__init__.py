"""Triton backend of the sparse ops (CUDA; CPU tensors under ``TRITON_INTERPRET=1``): ``mlp.py`` holds
the kernels and launchers, ``attention.py`` the head-sparse attention around them. Imported on first
CUDA use only: triton reads ``TRITON_INTERPRET`` when its kernels are decorated."""
