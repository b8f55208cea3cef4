import torch, sys, collections
from fusedserve.model.config import EncoderConfig
from fusedserve.model.families import family
from bench.encoder import embedder, lengths_for, token_rows
cfg = EncoderConfig.from_name("bert-base"); rows = token_rows(lengths_for(128, 128, True), cfg.vocab_size)
enc = family(cfg).encoder(cfg)
import copy
for prec in ("native", "fp8"):
    e = embedder(copy.deepcopy(enc), "cuda", torch.float16, backend="auto", graphs=False, max_tokens=16384, max_batch=256, precision=prec)
    with torch.inference_mode():
        for _ in range(3): e.launch_ids(rows).wait()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(5): e.launch_ids(rows).wait()
            torch.cuda.synchronize()
    agg = collections.Counter(); cnt = collections.Counter()
    for ev in p.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            agg[ev.name[:90]] += ev.device_time_total / 5 / 12; cnt[ev.name[:90]] += 1
    print(f"== {prec}: per layer us, total {sum(agg.values()):.1f}")
    for k, v in agg.most_common(14): print(f"{v:8.1f} {cnt[k]//5:4d} {k}")
