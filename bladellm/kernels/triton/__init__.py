"""Triton kernels for GPUs (each with a plain-PyTorch twin in kernels/ref.py or beside it)."""

from bladellm import envs

# Under TRITON_INTERPRET=1 (tests without a GPU) the interpreter's bfloat16 dot is wrong (numpy
# has no bf16): kernels take a float32 dot there, which changes only rounding.
INTERPRETING = envs.triton_interpret()
