"""``cas ui``: a local, read-only web view of a store's runs, checkpoints, storage and retention.

``views`` gathers what a page shows as plain data, ``pages`` and ``charts`` render it as HTML and
inline SVG (no script, nothing fetched from elsewhere), ``server`` answers HTML or JSON behind a
random token. See docs/ui.md.
"""
