"""Library bugs the tests document with ``xfail(strict=True, raises=KnownBug)``: the text
that identifies each in the worker logs, and why it fails."""

# load_state_dict on node-local disks: a rank that cannot read N.metadata asks its helper for
# the part of the metadata covering the boxes it holds (api._metadata_from_helpers sends only
# pieces whose box is not None; planner.restrict returns only those tensors). A tensor of
# which the rank holds nothing (outside its sub-mesh, or an empty shard) is then absent from
# that part, and api._plan_load reports it with the keys the checkpoint lacks: "keys of the
# state_dict not found in checkpoint ... (left unchanged)", naming keys the checkpoint holds.
MISSING_WARNING_BUG = "warned as missing from the checkpoint, though it holds them"
MISSING_WARNING_REASON = (
    "paddle_dcp.api._plan_load on a rank without the metadata file: tensors of which the rank "
    "holds no piece are missing from the partial metadata its helper sends, so the rank warns "
    "that the checkpoint lacks them"
)

# save_state_dict(async_save=True): the "stage" step replaces each piece to write with
# device.staged_copy(local), a numpy copy of its bytes in storage dtype, which is uint16 for
# bfloat16; the background write then calls device.host_bytes on that array, which asks
# dtypes.name_of_numpy(uint16) for a checkpoint dtype and raises FormatError. Every rank's
# AsyncSave.wait() raises CollectiveError(step 'write', FormatError ...); no checkpoint.
ASYNC_BF16_BUG = "numpy dtype uint16 has no checkpoint dtype"
ASYNC_BF16_REASON = (
    "paddle_dcp.api.save_state_dict(async_save=True): staged bfloat16 pieces are uint16 numpy "
    "arrays, and writing them raises FormatError('numpy dtype uint16 has no checkpoint dtype')"
)
