"""ZeRO stages 0-3 with CPU offload, within one pipeline stage's data-parallel group.

The runtime builds one :class:`ShardedStages` per rank over the modules of
its pipeline stages and calls its methods where the lowered schedule (see
:func:`mpar.schedule.lower_sharding`) says so::

    from mpar.shard import ShardedStages

    sharded = ShardedStages(
        {0: stage0, 4: stage4},           # this rank's stages: index -> module
        config.zero,                      # ZeroConfig(stage, offload_*, bucket_mb)
        group=grid.dp_group, group_ranks=grid.dp_ranks, rank_in_group=grid.dp_rank,
        device=st.device,
    )
    opt = sharded.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3))

    # one step, driven by the schedule:
    sharded.start_unshard(s)  # sUNSHARD: ZeRO-3 starts all-gathering stage s's parameters
    sharded.wait_unsharded(s) # before s computes (the gather may run ahead: prefetch)
    sharded.bind_grads(s)     # before s's first backward: .grad views into flat buffers
    ...  F / B actions ...    # (loss / dp_size).backward(): reductions are sums
    sharded.reduce_grads(s)   # sREDUCE_GRAD, after stage s's last backward (async)
    sharded.reshard(s)        # sRESHARD: ZeRO-3 frees the gathered parameters
    sharded.finish_grads()    # end of the schedule: wait for every reduction
    opt.grad_sq_norm()        # this rank's share; sum-all-reduce it over the world
    opt.scale_grads(c)        # clipping
    opt.step(); opt.zero_grad()

What each ZeRO stage keeps on a rank (``n`` = data-parallel size):

* 0: everything replicated; ``reduce_grads`` all-reduces (sum).
* 1: optimizer state sharded; gradients reduce-scattered, this rank's slice
  feeds the optimizer; after ``step`` the updated slices are all-gathered.
  Only the slice is kept after the reduction (as DeepSpeed does), so
  between steps stage 1 holds what stage 2 holds.
* 2: + gradients: reduce-scatter into this rank's gradient shard; the full
  gradients are freed once flattened.
* 3: + parameters: only the shard is kept (on the CPU with
  ``offload_params="cpu"``); ``unshard``/``reshard`` gather and free.

Parameters live in flat buckets (per stage, at most ``bucket_mb`` each),
zero-padded to a multiple of ``n``; the module parameters are views into them
(at ZeRO-3, empty tensors while resharded). A parameter shared by two local
stages is stored and reduced once, under the lower stage; frozen parameters
(``requires_grad=False``) are left as they are (replicated, never reduced).
The first rank of the group broadcasts the initial values, like DDP.

``wrap_optimizer`` rebuilds the same optimizer class with every parameter
group's options over *segments*: runs of this rank's slice that belong to one
original parameter group (views of the flat buffer, or of its fp32 CPU copy
with ``offload_optimizer="cpu"``, where the step also runs). Parameters the
optimizer does not list and parameters of other pipeline ranks are ignored.

Mixed precision (``compute_dtype=torch.bfloat16`` or ``torch.float16``):
buckets and parameters hold the compute dtype; gradients accumulate and
reduce in float32 (each backward's ``.grad`` folded into a float32 buffer;
call ``sharded.fold_grads()`` after writing ``.grad`` outside autograd), or in
the compute dtype with ``reduce_dtype=compute_dtype``; the optimizer
updates float32 master copies of this rank's slice and the results are
rounded back; fp16 adds a :class:`LossScaler` (``sharded.loss_scale``).
``tied=[(group, param), ...]`` names parameters that other pipeline ranks
hold a copy of: each gets its own bucket and its reduced gradient is summed
over ``group`` in ``finish_grads``.

Semantics to know: a parameter without a gradient on every replica gets a
zero gradient (as in DeepSpeed), so decoupled weight decay and momentum still
apply to it. ``offload_params="cpu"`` without ``offload_optimizer`` also
steps on the CPU (the CPU shard is what the optimizer updates).
"""

from mpar.shard._sharded_optimizer import ShardedOptimizer
from mpar.shard._sharded_stages import ShardedStages

__all__ = ["ShardedOptimizer", "ShardedStages"]
