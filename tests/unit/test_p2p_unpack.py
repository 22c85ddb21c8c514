"""Received messages: tensors unpacked from one buffer must not share autograd state."""

from __future__ import annotations

import torch

from mpar.comm._p2p import _offsets, _pack, _TensorSlot, _unpack


def _message(tensors):
    slots = [_TensorSlot(tuple(t.shape), t.dtype, False) for t in tensors]
    offsets, size = _offsets(slots)
    buffer = torch.empty(size, dtype=torch.uint8)
    _pack(buffer, 0, tensors, offsets)
    return buffer, slots


def test_several_tensors_get_their_own_storage():
    hidden, mask = torch.randn(2, 3), torch.tensor([[True, False, True]])
    buffer, slots = _message([hidden, mask])
    got_hidden, got_mask = _unpack(buffer, 0, slots)
    torch.testing.assert_close(got_hidden, hidden)
    assert torch.equal(got_mask, mask)
    # an in-place change of one leaves the other's version (saved for backward) alone
    version = got_mask._version
    got_hidden.add_(1.0)
    assert got_mask._version == version
    assert got_hidden.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()


def test_a_lone_tensor_is_a_view_of_the_message():
    hidden = torch.randn(4)
    buffer, slots = _message([hidden])
    (got,) = _unpack(buffer, 0, slots)
    torch.testing.assert_close(got, hidden)
    assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_the_control_block_carries_the_transfer_label():
    from mpar.comm._p2p import _control_words, _label_in
    from mpar.comm._types import Transfer, TransferLabel

    for label in (TransferLabel(Transfer.GRADIENTS, 3, 7), TransferLabel(Transfer.ACTIVATIONS, 1)):
        words = list(_control_words(1, 10, 20, label)) + [0] * 2
        assert words[:3] == [1, 10, 20] and _label_in(words) == label
    assert _label_in([1, 10, 20, 3, 9, 0, 0, 0]) is None  # no such transfer kind
    assert TransferLabel(Transfer.GRADIENTS, 0, 2).describe() == "gradients for 0B2"


def test_one_tensor_s_data_is_its_bytes_exactly():
    # (a device transport sends a lone contiguous tensor as it is, without a copy)
    slots = [_TensorSlot((3,), torch.float16, False)]
    assert _offsets(slots) == ([0], 6)
    slots.append(_TensorSlot((2,), torch.int64, False))
    assert _offsets(slots) == ([0, 16], 32)


def test_a_payload_unlike_its_agreed_spec_is_refused_before_anything_is_sent():
    import pytest

    from mpar.comm._p2p import Links, PendingSends, _spec, send_payload
    from mpar.comm._types import Transfer, TransferLabel
    from mpar.errors import StepError

    links, label = Links(), TransferLabel(Transfer.ACTIVATIONS, 1, 3)
    links.begin("signature")
    links.agreed[label] = _spec((_TensorSlot((4, 8), torch.float32, True),))
    pending = PendingSends()
    with pytest.raises(
        StepError, match=r"activations for 1F3 \(to rank 1\) is \(float32\[4, 16\],\)"
    ) as info:
        send_payload((torch.zeros(4, 16, requires_grad=True),), 1, label, pending, links)
    assert "but it was (float32[4, 8],) in the first step with these inputs" in str(info.value)
    assert "pad data-dependent shapes to a fixed size" in str(info.value)
    assert pending.works == []
