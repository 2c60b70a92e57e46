"""Model families, one module per family; import them through `registry`, which loads
each lazily by its Hugging Face `architectures` name."""
