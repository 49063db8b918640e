"""Wire types: one module per API family, attrs classes and no behaviour beyond validation."""
