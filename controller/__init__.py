"""The controller's process: a named Ray actor that owns the worker pools."""
