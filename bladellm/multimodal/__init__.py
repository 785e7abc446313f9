"""Images in prompts: the item type that travels with a request (``inputs``), image loading with
its limits (``image``) and the model's own transformers processor glue (``processor``).

``inputs`` is torch-free: the scheduler and the prompt-cache hashing read it.
"""
