"""Hand-made cost models with round numbers, so the right choice can be worked out by hand."""

import pytest

from halfmoon.policy.cost import CostModels, DecodeCostModel, PrefillCostModel, TransferModel


@pytest.fixture
def cost() -> CostModels:
    """1 ms per new prompt token; decode step 10 ms + 1 ms/request + 1 us/context token; 1 us/token transfer."""
    return CostModels(
        prefill=PrefillCostModel((0.0, 1e-3, 0.0, 0.0)),
        decode=DecodeCostModel((0.010, 1e-3, 1e-6)),
        transfer=TransferModel(bytes_per_token=1.0, bandwidth_bytes_per_s=1e6, latency_s=0.0),
    )


@pytest.fixture
def slow_transfer_cost(cost: CostModels) -> CostModels:
    """Transfer at 10 ms per token: pulling is always worse than recomputing at 1 ms per token."""
    return cost._replace(transfer=TransferModel(bytes_per_token=1.0, bandwidth_bytes_per_s=100.0, latency_s=0.0))
