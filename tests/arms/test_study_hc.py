"""hcstudy/arms/study_hc.py: the public study's HC (one RMS of the whole state, read, write and mix from one tanh
projection, the write to stream 0) against the study's layer rebuilt in tests/support/study_layer.py."""
from study_layer import assert_equals_the_studys_layer_in_fp64, assert_the_same_biases_at_init


def test_it_starts_where_the_study_starts():
    ours = assert_the_same_biases_at_init("study-hc")
    assert ours.B_static.tolist() == [1.0, 0.0, 0.0, 0.0]             # it writes stream 0 only


def test_it_equals_the_studys_layer_in_fp64():
    assert_equals_the_studys_layer_in_fp64("study-hc")
