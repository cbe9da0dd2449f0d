"""The head kernels: what they read and return (``structure``), the naive and fused
kernels (``head_kernels``; the fused one's parts in ``fused/``), the naive softmax
(``null_softmax``), the shared form (``shared_heads``), CUDA flex_attention (``flex``, its
block masks in ``flex_masks``), the precision every kernel computes in (``precision``) and
the choice between them (``choice``)."""
