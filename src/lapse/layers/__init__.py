"""Neural-network layers: features are constructor arguments, kinds are classes.

Norms, SwiGLU, rotary embedding, KV-shift, and the attention layer (:class:`Attention`:
projections and the Pro pieces) with its kinds: :class:`SoftmaxAttention` (RoPE + SDPA),
:class:`ForgettingAttention` (forget gate, ACP), :class:`DCPAttention` (softmax under
DCP's learned keep mask) and :class:`CastleAttention` (lookahead keys, CASTLE-SWL).
Layers call ``ops`` for attention and a ``kv`` protocol for decoding state; they never
read a config or an architecture name (``lapse.models.registry`` turns a config into these).
"""

from .attention import Attention
from .castle import CastleAttention
from .context import ContextParallel
from .dcp import DCPAttention, DCPStats
from .forgetting import ForgettingAttention
from .mlp import SwiGLU
from .norm import RMSNorm, compute_dtype
from .rotary import RotaryEmbedding
from .shift import KVShift, kv_shift
from .softmax import SoftmaxAttention

__all__ = [
    "Attention",
    "CastleAttention",
    "ContextParallel",
    "DCPAttention",
    "DCPStats",
    "ForgettingAttention",
    "KVShift",
    "RMSNorm",
    "RotaryEmbedding",
    "SoftmaxAttention",
    "SwiGLU",
    "compute_dtype",
    "kv_shift",
]
