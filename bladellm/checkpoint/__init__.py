"""Find and describe a model, torch-free: what both processes need before any weight is read.

``locate.py`` turns ``--model`` (a directory, a hub id, a .gguf file or ``demo``) into a
``ResolvedModel`` (path, config, context length); ``hf_config.py`` reads ``config.json``;
``hub.py`` fetches hub ids; ``gguf.py`` reads GGUF files (torch only where it makes tensors) and
``gguf_cache.py`` keeps their dense copies; ``resolution_cache.py`` remembers what transformers
resolved; ``model_len.py`` and ``pooling_config.py`` derive the context length and the pooling;
``demo.py`` finds the demo model. The API process imports this package and never
``bladellm.model``; building and loading the model (``bladellm.model.loader``) starts from it.
"""
