"""Target masks in packed micro-batches: targets only where the mask says, in CP shards too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hydraulis.errors import HydraulisError  # noqa: E402
from hydraulis.runtime.parallelism.batch import IGNORE_INDEX, concatenate_cp_shard, concatenate_documents  # noqa: E402

DOCS = [torch.arange(10, 17), torch.arange(20, 23), torch.arange(30, 41)]
MASKS = [
    torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.uint8),  # prompt of 3, completion of 4
    None,  # a plain document: every next token is a target
    torch.tensor([0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0], dtype=torch.uint8),  # two assistant turns
]


def expected_targets() -> list[int]:
    """Written out by hand from the rule: targets[t] = token t+1 of the same document if its mask is set."""
    first = [IGNORE_INDEX, IGNORE_INDEX, 13, 14, 15, 16, IGNORE_INDEX]
    second = [21, 22, IGNORE_INDEX]
    third = [IGNORE_INDEX, 32, 33, IGNORE_INDEX, IGNORE_INDEX, 36, 37, 38, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]
    return first + second + third


def test_masked_targets() -> None:
    packed = concatenate_documents(DOCS, masks=MASKS)
    assert packed.targets.tolist() == expected_targets()
    assert packed.num_targets == 4 + 2 + 5
    padded = concatenate_documents(DOCS, pad_to_multiple=4, masks=MASKS)
    assert padded.targets.tolist()[: len(expected_targets())] == expected_targets()
    assert padded.num_targets == packed.num_targets
    assert (concatenate_documents(DOCS, masks=[None, None, None]).targets.tolist()
            == concatenate_documents(DOCS).targets.tolist())


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_shards_keep_the_mask(cp: int) -> None:
    full = concatenate_documents(DOCS, masks=MASKS)
    rows = lambda b: sorted(zip(b.positions.tolist(), b.tokens.tolist(), b.targets.tolist(), strict=True))  # noqa: E731
    shards = [concatenate_cp_shard(DOCS, cp, r, masks=MASKS) for r in range(cp)]
    assert sorted(row for s in shards for row in rows(s)) == rows(full)
    assert sum(s.num_targets for s in shards) == full.num_targets


def test_bad_masks_are_one_line() -> None:
    with pytest.raises(HydraulisError, match="2 target masks for 3 documents"):
        concatenate_documents(DOCS, masks=MASKS[:2])
    with pytest.raises(HydraulisError, match="document 0: a target mask of 3 for 7 tokens"):
        concatenate_documents(DOCS, masks=[torch.ones(3), None, None])
