"""Triton kernels over the paged KV pool. To run them on a CPU (tests), set TRITON_INTERPRET=1 before importing."""
