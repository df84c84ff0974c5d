"""hcstudy/finite_state.py: every floating tensor of a checkpoint's state checked for NaN and infinity, named by
its file and key; integers and empty shards pass."""
import torch

from hcstudy.finite_state import floating_tensors, non_finite_flags, non_finite_problem


def test_only_floating_tensors_are_walked_in_key_order():
    state = {"model.pt": {"w": torch.ones(2), "steps": torch.tensor(3)}, "optimizer.pt": [torch.zeros(1), "x"]}
    assert [path for path, _ in floating_tensors(state)] == [("model.pt", "w"), ("optimizer.pt", 0)]


def test_a_finite_state_has_no_problem_and_each_file_names_its_first_bad_tensor():
    assert non_finite_problem({"model.pt": {"w": torch.ones(3)}, "rng": torch.tensor([1, 2])}) is None
    state = {"model.pt": {"a": torch.ones(2), "b": torch.tensor([1.0, float("nan")])},
             "optimizer.pt": {"state": {0: {"exp_avg": torch.tensor([float("inf")]),
                                            "exp_avg_sq": torch.tensor([-float("inf")])}}}}
    assert non_finite_problem(state, where="step-8/") == (
        "holds non-finite values (NaN or infinity) in step-8/model.pt (b) and step-8/optimizer.pt "
        "(2 tensors, the first state.0.exp_avg)")


def test_a_norm_past_the_dtypes_range_is_no_infinity_when_every_element_is_finite():
    large = torch.full((4,), 3e38)                 # the sum of squares overflows fp32; every element is finite
    half = torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)
    assert non_finite_flags([large, torch.empty(0), half, torch.ones(2, dtype=torch.float64)]) == [
        False, False, True, False]
