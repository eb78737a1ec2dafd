"""CPU backend in C and C++ (``native.py`` builds and loads ``cpu_sparse_mlp.c`` and ``cpu_ops.cpp``)."""
