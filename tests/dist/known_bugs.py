"""Library bugs the tests document with ``xfail(strict=True, raises=KnownBug)``: the text
that identifies each in the worker logs, and why it fails."""

# paddle 3.3.1 returns the placements of a tensor whose dim is sharded by two mesh dims
# ([Shard(0), Shard(0)], or Shard(0, shard_order=...)) as bare paddle.base.libpaddle.Placement
# objects, which have only is_shard / is_partial / is_replicated (the dim and order show only
# in repr(), e.g. "Shard(dim=0, shard_order=1)"); placements.describe calls get_dim() on them.
COSHARD_BUG = "'paddle.base.libpaddle.Placement' object has no attribute 'get_dim'"
COSHARD_REASON = (
    "paddle_dcp.placements.describe: co-sharded placements ([Shard(0), Shard(0)] on a 2-D mesh) "
    "come back from paddle as bare Placement objects without get_dim(); save and load raise "
    "CollectiveError(AttributeError) on every rank"
)

# save_state_dict -> placements.reduce_partial casts a float16/bfloat16 Partial tensor with
# value.astype("float32"); for a tensor also sharded unevenly on another mesh dim, paddle's
# cast first reshards that dim Shard -> Replicate (a collective). On the ranks with the short
# shard that reshard fails ("Full" is not implemented for bfloat16), on the others it waits
# in the collective; a rank whose shard is empty skips reduce_partial altogether
# (has_partial() is False when the local value is uninitialised). The ranks never meet:
# gloo times out after ~30 s and paddle aborts the process, instead of a CollectiveError.
PARTIAL_HALF_BUG = ("in reduce_partial", "step 'reduce partial' failed")
PARTIAL_HALF_REASON = (
    "paddle_dcp.placements.reduce_partial: value.astype('float32') on a float16/bfloat16 "
    "[Partial, Shard] tensor with uneven shards is a collective some ranks fail or skip; "
    "save_state_dict hangs until gloo's timeout and aborts instead of raising"
)
