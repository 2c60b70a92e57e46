"""Frontend side of the engine: input/output processing, detokenization, engine clients.

Kept import-free so `import pagellm.engine.<module>` stays cheap.
"""
