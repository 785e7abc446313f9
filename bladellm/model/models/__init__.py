"""Model implementations; ``bladellm.model.registry`` maps HF architecture names to them."""
