"""megatron-core's multi_latent_attention module (megatron.core.transformer.multi_latent_attention)."""
from __future__ import annotations


def have_te_from_the_extension() -> None:
    """Make multi_latent_attention.HAVE_TE say whether transformer-engine is there
    (megatron.core.extensions.transformer_engine.HAVE_TE), as megatron-core 0.17+ read it.

    Why: 0.16.1's multi_latent_attention sets HAVE_TE when it can import the extension's TELinear,
    which imports without transformer-engine too (as a MagicMock stand-in), so every MLA layer's
    __init__ calls isinstance(linear_proj, TELinear) and fails: "isinstance() arg 2 must be a
    type, a tuple of types, or a union". With HAVE_TE False that fp8/fp4 branch is skipped, as
    on a GPU without transformer-engine it should be.
    """
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    multi_latent_attention.HAVE_TE = transformer_engine.HAVE_TE


# The megatron-core releases that need it: [first, end). 0.17.0 imports HAVE_TE from the extension.
RELEASES = ((0, 16, 1), (0, 17, 0))
