"""costmodel: hardware profiles and primitive costs (compute, collectives, p2p, memory).

Knows nothing of SBP or graphs (arrows: runtime -> autosbp -> costmodel). Start with
`Cluster(load_profile("dgx-a100"), nodes=128)` and ask it `op_time_s`, `collective_time_s`,
`p2p_time_s`, `memory_bytes` and `link_class_for_mesh_dim`. Profiles are JSON files validated by
costmodel/schemas/profile.schema.json; `autosbp profile` measures one (costmodel.measure.profiler).
"""

from costmodel.cluster import Cluster
from costmodel.errors import ProfileError
from costmodel.profile import (
    CollectiveKind,
    DType,
    LinkClass,
    Profile,
    Quantity,
    Source,
    SourceKind,
)
from costmodel.profile_io import load_profile, save_profile, shipped_profiles

__all__ = [
    "Cluster",
    "CollectiveKind",
    "DType",
    "LinkClass",
    "Profile",
    "ProfileError",
    "Quantity",
    "Source",
    "SourceKind",
    "load_profile",
    "save_profile",
    "shipped_profiles",
]
