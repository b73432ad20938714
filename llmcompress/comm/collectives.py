"""Compressed collectives over torch.distributed, bit-identical to a plain collective run in the same order.

What "bit-identical" means here: ZipCCL is lossless, so a compressed collective moves exactly the
bits a plain one moves. Each reduction has a *reference* with a fixed order, implemented by the same
code with compression switched off (`compress=False`):

* reduce-scatter: rank r owns shard r (`torch.tensor_split(flat, world)`); it sums the world's
  pieces of that shard **in rank order, in float32** (`acc = piece_0.float(); acc += piece_1.float(); ...`),
  optionally multiplies by `scale` (e.g. 1/world) in float32, then casts to the tensor's dtype.
* all-reduce = reduce-scatter, then all-gather of the reduced shards, so every rank ends with the
  same bits.
For two ranks and float32 tensors this equals `dist.all_reduce(SUM)` bit for bit (a + b is
commutative); for more ranks or 16-bit tensors a plain backend may sum in another order, so the
comparison is against the reference.

Messages move as uint8 tensors: sizes first (int64), then payloads, peer to peer (works on gloo
and nccl; with nccl the bytes are staged on the GPU).
"""


import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmcompress.lossless import codec

log = logging.getLogger("llmcompress.comm")


def _dev(group) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _to_wire(blob: bytes | memoryview, dev) -> torch.Tensor:
    t = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if len(blob) else torch.zeros(0, dtype=torch.uint8)
    return t.to(dev)


def _encode(t: torch.Tensor, compress: bool, threads: int) -> bytes:
    if compress:
        return codec.encode(t.detach().cpu(), threads=threads).to_bytes()
    t = t.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _decode(b: torch.Tensor, like: torch.Tensor, compress: bool, threads: int) -> torch.Tensor:
    data = b.cpu().numpy()
    if compress:
        out = codec.decode(codec.Encoded.from_bytes(data), threads=threads)
    else:
        out = torch.from_numpy(data.copy()).view(like.dtype) if data.size else torch.empty(0, dtype=like.dtype)
    return out.reshape(like.shape).to(like.device)


def _exchange(outgoing: list[bytes], group=None, tally=None) -> list[torch.Tensor]:
    """Send outgoing[j] to rank j, receive incoming[i] from rank i (own entry passes through).

    `tally` (an object with `bytes_sent`, e.g. a Strategy) counts the bytes sent to the other ranks.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if tally is not None:
        tally.bytes_sent += sum(8 + len(b) for j, b in enumerate(outgoing) if j != rank)
    dev = _dev(group)
    sizes_out = [torch.tensor([len(b)], dtype=torch.int64, device=dev) for b in outgoing]
    sizes_in = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    reqs = []
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        reqs.append(dist.isend(sizes_out[dst], dist.get_global_rank(group, dst) if group else dst, group=group))
        reqs.append(dist.irecv(sizes_in[src], dist.get_global_rank(group, src) if group else src, group=group))
    for r in reqs:
        r.wait()
    incoming = [torch.empty(int(sizes_in[i].item()), dtype=torch.uint8, device=dev) for i in range(world)]
    incoming[rank] = _to_wire(outgoing[rank], dev)
    reqs = []
    for k in range(1, world):
        dst, src = (rank + k) % world, (rank - k) % world
        w = _to_wire(outgoing[dst], dev)
        if w.numel():
            reqs.append(dist.isend(w, dist.get_global_rank(group, dst) if group else dst, group=group))
        if incoming[src].numel():
            reqs.append(dist.irecv(incoming[src], dist.get_global_rank(group, src) if group else src, group=group))
    for r in reqs:
        r.wait()
    return incoming


def all_gather(tensor: torch.Tensor, group=None, *, compress: bool = True, threads: int = 1, tally=None) -> list[torch.Tensor]:
    """Every rank's tensor (same shape and dtype on all ranks), in rank order."""
    world = dist.get_world_size(group)
    blob = _encode(tensor, compress, threads)
    incoming = _exchange([blob] * world, group, tally)
    return [_decode(b, tensor, compress, threads) for b in incoming]


def _shards(flat: torch.Tensor, world: int) -> list[torch.Tensor]:
    return list(torch.tensor_split(flat, world))


def reduce_scatter(
    tensor: torch.Tensor, group=None, *, compress: bool = True, threads: int = 1, scale: float | None = None, tally=None
) -> torch.Tensor:
    """Rank r gets shard r of sum over ranks (rank-ordered float32 sum, times `scale`, cast back)."""
    world = dist.get_world_size(group)
    flat = tensor.detach().reshape(-1)
    shards = _shards(flat, world)
    incoming = _exchange([_encode(s, compress, threads) for s in shards], group, tally)
    mine = shards[dist.get_rank(group)]
    acc = None
    for b in incoming:  # rank order
        piece = _decode(b, mine, compress, threads).float()
        acc = piece if acc is None else acc.add_(piece)
    if scale is not None:
        acc.mul_(scale)
    return acc.to(tensor.dtype)


def all_reduce(
    tensor: torch.Tensor, group=None, *, compress: bool = True, threads: int = 1, scale: float | None = None, tally=None
) -> torch.Tensor:
    """Sum over ranks (see module doc for the order); returns a new tensor of tensor's shape."""
    world = dist.get_world_size(group)
    shard = reduce_scatter(tensor, group, compress=compress, threads=threads, scale=scale, tally=tally)
    shapes = [s.numel() for s in _shards(tensor.reshape(-1), world)]
    blob = _encode(shard, compress, threads)
    incoming = _exchange([blob] * world, group, tally)
    parts = [
        _decode(b, torch.empty(n, dtype=tensor.dtype, device=tensor.device), compress, threads)
        for b, n in zip(incoming, shapes)
    ]
    return torch.cat(parts).reshape(tensor.shape)


# ------------------------------------------------------------------------------------------------
# adaptive strategy
# ------------------------------------------------------------------------------------------------


@dataclass
class Strategy:
    """Choose compressed or plain per message from measured codec throughput and link bandwidth.

    Compressed pays when  t_enc + ratio * bytes / bw + t_dec  <  bytes / bw, i.e. below the
    break-even bandwidth  bw* = bytes * (1 - ratio) / (t_enc + t_dec).
    """

    link_MBps: float | None = None  # measured by `measure_link` when None
    min_bytes: int = 64 * 1024  # smaller messages always go plain
    threads: int = 1
    force: str | None = None  # "compressed" | "plain" to override
    codec_stats: dict = field(default_factory=dict)  # dtype -> (enc MB/s, dec MB/s, ratio)
    decisions: list = field(default_factory=list)
    bytes_sent: int = 0  # what the hook sent to the other ranks (sizes and payloads)

    def measure_codec(self, dtype: torch.dtype, numel: int = 1 << 20) -> tuple[float, float, float]:
        key = str(dtype)
        if key not in self.codec_stats:
            x = (torch.randn(numel) * 0.02).to(dtype)
            codec.decode(codec.encode(x[:4096]))  # load kernels
            t0 = time.perf_counter()
            enc = codec.encode(x, threads=self.threads)
            t1 = time.perf_counter()
            codec.decode(enc, threads=self.threads)
            t2 = time.perf_counter()
            mb = x.numel() * x.element_size() / 1e6
            self.codec_stats[key] = (mb / (t1 - t0), mb / (t2 - t1), enc.nbytes / (mb * 1e6))
        return self.codec_stats[key]

    def measure_link(self, group=None, nbytes: int = 4 << 20) -> float:
        if self.link_MBps is None:
            x = torch.zeros(nbytes // 4, dtype=torch.float32, device=_dev(group))
            dist.all_reduce(x, group=group)  # warm up
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            dt = time.perf_counter() - t0
            # a ring all-reduce moves 2 (w-1)/w of the bytes per rank
            w = dist.get_world_size(group)
            t = torch.tensor([nbytes * 2 * (w - 1) / w / 1e6 / max(dt, 1e-9)], dtype=torch.float64, device=x.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)  # every rank decides the same way
            self.link_MBps = float(t.item())
        return self.link_MBps

    def break_even_MBps(self, dtype: torch.dtype) -> float:
        enc, dec, ratio = self.measure_codec(dtype)
        return (1 - ratio) / (1 / enc + 1 / dec)

    def choose(self, nbytes: int, dtype: torch.dtype, group=None) -> bool:
        if self.force is not None:
            use = self.force == "compressed"
            why = "forced"
        elif str(dtype).replace("torch.", "") not in ("bfloat16", "float16", "float32") or nbytes < self.min_bytes:
            use, why = False, "small or unsupported"
        else:
            bw = self.measure_link(group)
            be = self.break_even_MBps(dtype)
            use = bw < be
            why = f"link {bw:.0f} MB/s vs break-even {be:.0f} MB/s"
        self.decisions.append({"bytes": nbytes, "dtype": str(dtype), "compressed": use, "why": why})
        log.info("comm: %d bytes %s -> %s (%s)", nbytes, dtype, "compressed" if use else "plain", why)
        return use


# ------------------------------------------------------------------------------------------------
# DDP communication hook
# ------------------------------------------------------------------------------------------------


def zipccl_hook(state: Strategy | None, bucket) -> torch.futures.Future[torch.Tensor]:
    """DDP hook: averaged gradients via `all_reduce`, compressed or plain as `state` decides.

    Use `model.register_comm_hook(Strategy(), zipccl_hook)`. Each rank scales its bucket by
    1/world first (as DDP's default hook does), then sums in rank order in float32.
    """
    strategy = state or Strategy()
    buf = bucket.buffer()
    group = dist.group.WORLD
    world = dist.get_world_size(group)
    use = strategy.choose(buf.numel() * buf.element_size(), buf.dtype, group)
    buf.div_(world)
    out = all_reduce(buf, group, compress=use, threads=strategy.threads, tally=strategy)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(out)
    return fut


def break_even_table(strategy: Strategy, dtypes=(torch.bfloat16, torch.float32)) -> list[dict]:
    rows = []
    for dt in dtypes:
        enc, dec, ratio = strategy.measure_codec(dt)
        rows.append({"dtype": str(dt).replace("torch.", ""), "enc_MBps": round(enc, 1), "dec_MBps": round(dec, 1),
                     "ratio": round(ratio, 4), "break_even_MBps": round(strategy.break_even_MBps(dt), 1)})  # fmt: skip
    return rows
