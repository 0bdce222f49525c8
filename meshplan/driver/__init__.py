"""driver: the user-level entry points that tie the layers together."""
