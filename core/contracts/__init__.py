"""Abstract contracts that plugins implement. Each module imports torch only for type checking."""
