"""Checkpoints on a real S3 server (SeaweedFS on 127.0.0.1; the AWS_* variables come from the
test's environment), compared with the numpy oracle.

Usage (under paddle.distributed.launch): s3.py URL SCENARIO [case ...]
  2       2 ranks: save Shard(0) (with a tensor large enough for multipart uploads of 5 MiB
          parts), load into other layouts, unique_id=None numbering, a replaced id, a load
          that sends only ranged GETs (counted on the wire by a botocore event hook), and the
          LISTs of a save and a load (counted the same way), a Hugging Face directory in the
          bucket loaded with safetensors=True (its index and headers read by the coordinator).
  4       4 ranks: a [2, 2] mesh save loaded into 1-D layouts and replicated.
  crash   2 ranks: checkpoint 0 saved; during the save of checkpoint 1, rank 1 exits after
          its first part is uploaded (os._exit: no cleanup runs).
  check   one process, no launcher: what the crash left (checkpoint 0 loads, no metadata of
          1, rank 1's upload open) and that ``clean`` aborts that upload.
"""
import os
import sys


URL, SCENARIO = sys.argv[1].rstrip("/"), sys.argv[2]
OPTIONS = {"part_size": 5 << 20, "parts_in_flight": 2, "retries": 3, "retry_deadline": 20}

import common as c  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # tests/
from s3server import Requests  # noqa: E402
import paddle_dcp  # noqa: E402
from paddle_dcp.io import open_storage  # noqa: E402
from paddle_dcp.io import storage as dcp_storage  # noqa: E402

BIG = c.Leaf(("big", "w"), (4096, 1024), "float32", index=9)  # 16 MiB: 8 MiB per rank over 2


def with_big(leaves, mesh, spec):
    return leaves + [c.Leaf(BIG.path, BIG.shape, BIG.dtype, mesh, spec, index=BIG.index)]


def save(leaves, name, variant=0, **kwargs):
    paddle_dcp.save_state_dict(c.build(leaves, variant, {"tag": name}), f"{URL}/{name}", storage_options=OPTIONS, **kwargs)


def load(leaves, name, variant=0, **kwargs):
    sd = c.build(leaves, variant, {"tag": ""}, target=True)
    paddle_dcp.load_state_dict(sd, f"{URL}/{name}", storage_options=OPTIONS, **kwargs)
    c.check_state(sd, leaves, variant, c.rank())
    assert sd["tag"] == name, sd["tag"]


def numbering(leaves):
    """unique_id=None takes one more than the highest complete id; a save of an existing id
    writes a new generation, then the old data objects go."""
    save(leaves, "num", variant=0)
    save(leaves, "num", variant=1)
    meta = paddle_dcp.read_metadata(f"{URL}/num", storage_options=OPTIONS)
    assert meta.unique_id == 1, meta.unique_id
    save(leaves, "num", variant=2, unique_id=1)
    load(leaves, "num", variant=0, unique_id=0)
    load(leaves, "num", variant=2)
    names = sorted(open_storage(f"{URL}/num", OPTIONS).sizes())
    assert names == sorted(["0.0.claim", "0.metadata", "0_0.distcp", "1_0.distcp", "1.1.claim", "1.metadata", "0_1.1.distcp",
                           "1_1.1.distcp"]), names


class Wire:
    """Every request the S3 client sends, as (operation, key, Range header), seen by a
    botocore event hook (what goes on the wire, not what our code meant to send)."""

    def __init__(self, fs):
        self.seen = []
        fs.s3.meta.events.register("before-send.s3", self)

    def __call__(self, request, **kwargs):
        rng = request.headers.get("Range")
        self.seen.append((request.method, request.url.split("?")[0], rng.decode() if isinstance(rng, bytes) else rng))


def ranged_gets(mesh):
    """A load into the saved layout (of sharded tensors only: each rank wrote its own pieces)
    GETs only byte ranges of this rank's own data file, exactly the bytes of its pieces (give
    or take the alignment gaps), in few coalesced requests; with checksums on, the same bytes
    (the ranges checked are kept for the copy, within read_cache_bytes)."""
    spec = (("S", 0),)
    leaves = [c.Leaf(("t", "a"), (7, 6), "float32", mesh, spec, index=0),
              c.Leaf(("t", "c"), (9, 4), "int64", mesh, spec, index=2)]
    leaves = with_big(leaves, mesh, spec)
    save(leaves, "ranged")
    mine = sum(c.storage(leaf.glob(0), leaf.dtype)[c.local_slices(leaf.shape, leaf.mesh.shape, leaf.mesh.coord(c.rank()), leaf.spec)].nbytes
               for leaf in leaves)
    for verify in (False, True):
        wire = Wire(open_storage(f"{URL}/ranged", OPTIONS).fs)
        load(leaves, "ranged", verify=verify)
        gets = [(url, rng) for method, url, rng in wire.seen if method == "GET" and url.endswith(".distcp")]
        assert gets, wire.seen
        assert all(rng is not None for _, rng in gets), gets  # never a whole object
        assert {url.rsplit("/", 1)[1] for url, _ in gets} == {f"{c.rank()}_0.distcp"}, gets
        assert len(gets) <= 1 + mine // (32 << 20) + 2, gets  # coalesced
        total = 0
        for _, rng in gets:
            first, last = map(int, rng.split("=")[1].split("-"))
            total += last - first + 1
        assert mine <= total <= mine + 64 * len(leaves), (verify, mine, total)


def missing_id(mesh):
    """A given id without its metadata object: every rank raises, naming the object that the
    coordinator, the one rank that reads it, did not find (no rank waits for another)."""
    from paddle_dcp.errors import CollectiveError

    leaves = c.mixed_layout(mesh, (("S", 0),))
    try:
        load(leaves, "s0", unique_id=99)
    except CollectiveError as exc:
        assert "has no metadata file" in str(exc) and "s0/99.metadata" in str(exc), exc
        assert sorted(exc.failures) == [0], exc.failures
    else:
        raise AssertionError("loading a missing id did not fail")


def listings(mesh):
    """All ranks see one bucket, so the coordinator alone lists: the prefix and its open uploads
    once per save (to choose the id, find the generation, abort what a crashed save left, and
    tidy up for every rank), the prefix once per load of the latest id and never for a load of
    a given id; the coordinator alone GETs the metadata on a load. Replacing an id deletes the
    old generation's objects in one batch request."""
    leaves = c.mixed_layout(mesh, (("S", 0),))
    save(leaves, "lists")  # the client's first requests
    coordinator = c.rank() == 0
    with Requests(open_storage(f"{URL}/lists", OPTIONS).fs) as wire:
        for unique_id in (None, 1, 0):  # a new id (1), then ids 1 and 0 replaced (new generations)
            wire.clear()
            save(leaves, "lists", unique_id=unique_id)
            lists = (wire.count("ListObjectsV2"), wire.count("ListMultipartUploads"))
            assert lists == ((1, 1) if coordinator else (0, 0)), (unique_id, wire.seen)
            deletes = (wire.count("DeleteObjects"), wire.count("DeleteObject"))
            assert deletes == ((1, 0) if coordinator and unique_id is not None else (0, 0)), (unique_id, wire.seen)
        for unique_id in (None, 1):  # the latest: the coordinator lists to find it; a given id: nobody
            wire.clear()
            load(leaves, "lists", unique_id=unique_id)
            lists = (wire.count("ListObjectsV2"), wire.count("ListMultipartUploads"))
            assert lists == ((1 if coordinator and unique_id is None else 0), 0), (unique_id, wire.seen)
            # the coordinator alone GETs the metadata and broadcasts it; every rank GETs its data
            metadata = [name for name in wire.gets if name.endswith(".metadata")]
            assert metadata == ([f"{unique_id or 1}.metadata"] if coordinator else []), (unique_id, wire.gets)
            assert any(name.endswith(".distcp") for name in wire.gets), wire.gets
    from paddle_dcp.io import open_storage as storage_of

    names = sorted(storage_of(f"{URL}/lists", OPTIONS).sizes())
    # ids 0 and 1, both replaced: generation 1 of both ranks' files, nothing of generation 0 left
    assert names == ["0.1.claim", "0.metadata", "0_0.1.distcp", "0_1.1.distcp", "1.1.claim", "1.metadata", "1_0.1.distcp",
                     "1_1.1.distcp"], names


def hf_directory(mesh):
    """A Hugging Face directory (an index and two shards, written by the safetensors package)
    in the bucket loads with safetensors=True into Shard(0) and Shard(1), the oracle's slices
    exactly; the coordinator alone lists the prefix and reads the index and the headers (it
    broadcasts them); every rank GETs only ranges of the shards for its tensors' bytes."""
    import json

    from safetensors.numpy import save as to_bytes

    tensors = {"embed.weight": ((8, 6), "float32", 0), "layers.0.w": ((6, 10), "int64", 1), "layers.0.b": ((4, 2), "float64", 2)}
    shards = {"model-00001-of-00002.safetensors": ["embed.weight"], "model-00002-of-00002.safetensors": ["layers.0.w", "layers.0.b"]}
    arrays = {k: c.global_array(shape, dtype, variant=v) for k, (shape, dtype, v) in tensors.items()}
    fs = open_storage(f"{URL}/hf", OPTIONS).fs
    root = f"{URL}/hf".split("://", 1)[1]
    if c.rank() == 0:
        for name, keys in shards.items():
            fs.pipe_file(f"{root}/{name}", to_bytes({k: arrays[k] for k in keys}))
        weight_map = {k: name for name, keys in shards.items() for k in keys}
        fs.pipe_file(f"{root}/model.safetensors.index.json", json.dumps({"metadata": {}, "weight_map": weight_map}).encode())
    import paddle.distributed as dist

    dist.barrier()
    for spec in ((("S", 0),), (("S", 1),)):
        sd = {k: c.make(arrays[k], tensors[k][1], mesh, spec, fill=0) for k in tensors}
        with Requests(open_storage(f"{URL}/hf", OPTIONS).fs) as wire:
            paddle_dcp.load_state_dict(sd, f"{URL}/hf", storage_options=OPTIONS, safetensors=True)
        for k, (shape, dtype, _) in tensors.items():
            c.check_tensor(sd[k], arrays[k], dtype, mesh, spec, c.rank(), f"{spec}: {k}")
        lists = wire.count("ListObjectsV2")
        assert lists == (1 if c.rank() == 0 else 0), (spec, wire.seen)
        assert ("model.safetensors.index.json" in wire.gets) == (c.rank() == 0), (spec, wire.gets)
        assert set(wire.gets) <= set(shards) | {"model.safetensors.index.json"}, wire.gets
        if c.rank() != 0:  # its own tensors' bytes only: one GET per shard it reads, no header reads
            assert len(wire.gets) <= len(shards), (spec, wire.gets)


def main():
    import paddle.distributed as dist

    dist.init_parallel_env()
    m = c.Mesh([0, 1])
    S0, S1 = (("S", 0),), (("S", 1),)
    if SCENARIO == "2":
        s0 = with_big(c.mixed_layout(m, S0), m, S0)
        cases = {
            "save_s0": lambda: save(s0, "s0"),
            "s0_into_s1": lambda: load(with_big(c.mixed_layout(m, S1), m, S1), "s0"),
            "s0_into_replicate": lambda: load(with_big(c.mixed_layout(m, ("R",)), m, ("R",)), "s0"),
            "s0_into_numpy": lambda: load(c.mixed_layout(kind="numpy") + [BIG], "s0", strict=False),
            "numbering": lambda: numbering(c.mixed_layout(m, S0)),
            "ranged_gets": lambda: ranged_gets(m),
            "listings": lambda: listings(m),
            "missing_id": lambda: missing_id(m),
            "hf_directory": lambda: hf_directory(m),
        }
    elif SCENARIO == "4":
        m2 = c.Mesh([[0, 1], [2, 3]])
        two_d = with_big(c.mixed_layout(m2, (("S", 0), ("S", 1))), m2, (("S", 0), ("S", 1)))
        m4 = c.Mesh([0, 1, 2, 3])
        cases = {
            "save_2d": lambda: save(two_d, "2d"),
            "2d_into_1d_s1": lambda: load(with_big(c.mixed_layout(m4, S1), m4, S1), "2d"),
            "2d_into_replicate": lambda: load(with_big(c.mixed_layout(m2, ("R", "R")), m2, ("R", "R")), "2d"),
        }
    elif SCENARIO == "crash":
        s0 = with_big(c.mixed_layout(m, S0), m, S0)
        cases = {"save_first": lambda: save(s0, "crash", variant=0), "crash": lambda: crash(s0)}
    else:
        raise SystemExit(f"unknown scenario {SCENARIO}")
    c.run_cases(cases, sys.argv[3:])


def crash(leaves):
    from paddle_dcp.io import multipart

    if c.rank() == 1:
        upload = multipart.MultipartWriter._upload_part

        def upload_then_die(self, number, body):
            upload(self, number, body)
            print(f"DIED after part {number} of {self.url}", flush=True)
            os._exit(3)

        multipart.MultipartWriter._upload_part = upload_then_die
    save(leaves, "crash", variant=1)
    raise AssertionError("the save of checkpoint 1 finished although rank 1 died in it")


def check():
    """One process: checkpoint 0 still loads whole (numpy targets: the global arrays), 1 has no
    metadata, rank 1's upload is open and ``clean`` aborts it."""
    url = f"{URL}/crash"
    store = open_storage(url, OPTIONS)
    listing = dcp_storage.list_checkpoints(store)
    assert listing.complete == frozenset({0}), listing
    tmp = [n for n in listing.temporary if n.startswith("1_1.distcp.tmp.")]
    assert tmp, listing
    leaves = c.mixed_layout(kind="numpy") + [BIG]
    sd = c.build(leaves, 0, {"tag": ""}, target=True)
    paddle_dcp.load_state_dict(sd, url, storage_options=OPTIONS, strict=False)
    c.check_state(sd, leaves, 0, 0)
    assert sd["tag"] == "crash"
    from paddle_dcp.tools import cli

    assert cli.main(["clean", url]) == 0
    assert not dcp_storage.list_checkpoints(store).temporary, dcp_storage.list_checkpoints(store)
    reply = store.s3("list_multipart_uploads", Prefix=store.key_prefix)
    assert not reply.get("Uploads"), reply
    sd = c.build(leaves, 0, {"tag": ""}, target=True)
    paddle_dcp.load_state_dict(sd, url, storage_options=OPTIONS, strict=False)
    c.check_state(sd, leaves, 0, 0)
    print("PASS check rank=0", flush=True)


if SCENARIO == "check":
    check()
else:
    main()
