"""The fused (memory-linear) head kernel: its steps (``kernel``: the scores of each part of a
row, the row normalisers and the messages; ``head_kernels.fused`` is the entry), the far
attention over the keys a query block can reach, with its forward and backward
(``far_attention``), and the assembly of the near bands and far messages
(``message_assembly``)."""
