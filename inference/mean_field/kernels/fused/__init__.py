"""The fused (memory-linear) head kernel's parts: the far attention over the keys a
query block can reach, with its forward and backward (``far_attention``), and the
assembly of the near bands and far messages (``message_assembly``)."""
