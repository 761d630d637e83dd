"""Content-addressed objects: the one door where a chunk is hashed, encoded and written, and read
back verified; also listing, refreshing, copying and sweeping objects by kind and digest."""
