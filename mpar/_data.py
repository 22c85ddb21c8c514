"""Data for the ranks: ``mpar.data_sampler`` shards a dataset by data-parallel rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from mpar.comm import state

if TYPE_CHECKING:
    from torch.utils.data import Dataset, DistributedSampler

__all__ = ["data_sampler"]

T = TypeVar("T")


def data_sampler(dataset: Dataset[T], **kwargs: Any) -> DistributedSampler[T]:
    """A ``torch.utils.data.DistributedSampler`` over ``dataset`` for this rank's
    data-parallel replica: ``num_replicas=mpar.dp_size()``, ``rank=mpar.dp_rank()``.

    Every rank of one pipeline gets the same samples (stage 0 reads the inputs,
    the last stage the targets); the replicas get disjoint ones. ``kwargs`` go
    to the sampler (``shuffle``, ``seed``, ``drop_last``); call
    ``sampler.set_epoch(epoch)`` each epoch as usual. A sampler over the global
    rank (the default ``DistributedSampler``) gives a pipeline's stages other
    samples: the step raises :class:`mpar.errors.BatchMismatchError`.
    """
    from torch.utils.data import DistributedSampler

    for key in ("num_replicas", "rank"):
        if key in kwargs:
            raise TypeError(
                f"mpar.data_sampler sets {key} itself (from mpar.dp_size() and "
                "mpar.dp_rank()); leave it out"
            )
    st = state()
    return DistributedSampler(dataset, num_replicas=st.grid.dp_size, rank=st.grid.dp_rank, **kwargs)
