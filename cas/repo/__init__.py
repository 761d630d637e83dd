"""The Repository facade, and opening a store by URL."""
