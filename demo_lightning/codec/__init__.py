"""Pure tensor code of the DeMo exchange: the tile transforms (DCT, Haar, identity), tiling, selection and wire packing.

Nothing here touches ``torch.distributed``; every function is deterministic for a given input.
"""

from demo_lightning.codec.bases import TRANSFORMS, Transform, haar_basis, inverse_tile_transform, tile_transform, transform_basis
from demo_lightning.codec.chunking import TileLayout, from_tiles, plan_tiles, to_tiles
from demo_lightning.codec.dct import dct2, dct_basis, idct2
from demo_lightning.codec.packing import (
    DEFAULT_HEAD_SHARE,
    VALUE_FORMATS,
    ValueFormat,
    head_count,
    index_bits,
    pack_bits,
    pack_segment,
    pack_segments,
    quantize_values,
    saturate,
    saturation_limit,
    positions_nbytes,
    segment_nbytes,
    unpack_bits,
    unpack_segment,
    unpack_segments,
    values_nbytes,
)
from demo_lightning.codec.selection import (
    SELECTIONS,
    Selection,
    coefficients_per_tile,
    lowpass_order,
    lowpass_positions,
    select,
    validate_strength,
)

__all__ = [
    "TRANSFORMS",
    "Transform",
    "haar_basis",
    "inverse_tile_transform",
    "tile_transform",
    "transform_basis",
    "DEFAULT_HEAD_SHARE",
    "SELECTIONS",
    "VALUE_FORMATS",
    "Selection",
    "TileLayout",
    "ValueFormat",
    "coefficients_per_tile",
    "dct2",
    "dct_basis",
    "from_tiles",
    "head_count",
    "idct2",
    "index_bits",
    "lowpass_order",
    "lowpass_positions",
    "pack_bits",
    "pack_segment",
    "pack_segments",
    "plan_tiles",
    "quantize_values",
    "saturate",
    "saturation_limit",
    "positions_nbytes",
    "segment_nbytes",
    "select",
    "to_tiles",
    "unpack_bits",
    "unpack_segment",
    "unpack_segments",
    "validate_strength",
    "values_nbytes",
]
