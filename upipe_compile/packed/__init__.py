"""Packed documents: the boundaries every rank agrees on and the document-aware SDPA op."""
