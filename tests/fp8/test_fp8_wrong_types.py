"""The public FP8 functions and classes given a wrong type: a ``TypeError`` naming the argument,
the value's type and what is allowed, instead of an ``AttributeError`` from deep inside."""

from __future__ import annotations

import re

import pytest
from torch import nn

from amp_plugin.fp8 import Fp8Conv1D, Fp8Layers, Fp8Linear, Fp8Recipe, classify, convert_to_fp8, eligible

NOT_A_MODEL = ["x", 5, None, [nn.Linear(2, 2)], {"fc": nn.Linear(2, 2)}]


@pytest.mark.parametrize("value", NOT_A_MODEL, ids=lambda v: type(v).__name__)
def test_convert_to_fp8_given_no_module_names_the_argument_and_type(value):
    with pytest.raises(TypeError, match=rf"^model=.* \({type(value).__name__}\) is not allowed: .*torch\.nn\.Module"):
        convert_to_fp8(value)


@pytest.mark.parametrize("function", [classify, eligible])
@pytest.mark.parametrize("value", NOT_A_MODEL, ids=lambda v: type(v).__name__)
def test_classify_and_eligible_given_no_module(function, value):
    with pytest.raises(TypeError, match=rf"^model=.* \({type(value).__name__}\) is not allowed"):
        function(value, Fp8Recipe())


@pytest.mark.parametrize("value", ["hybrid", 5, {"fp8_format": "hybrid"}], ids=lambda v: type(v).__name__)
def test_a_recipe_that_is_no_fp8_recipe(value):
    model = nn.Sequential(nn.Linear(16, 16))
    expected = rf"^recipe=.* \({type(value).__name__}\) is not allowed: .*Fp8Recipe"
    with pytest.raises(TypeError, match=expected + " or None"):
        convert_to_fp8(model, recipe=value)
    for call in (
        lambda: classify(model, value),
        lambda: eligible(model, value),
        lambda: Fp8Layers({}, value),
        lambda: Fp8Linear.from_linear(nn.Linear(16, 16), value),
    ):
        with pytest.raises(TypeError, match=expected):
            call()
    with pytest.raises(TypeError, match=r"^recipe=None \(NoneType\) is not allowed"):
        classify(model, None)


def test_reduce_must_be_callable():
    with pytest.raises(TypeError, match=r"^reduce=3 \(int\) is not allowed: .*callable.* or None"):
        convert_to_fp8(nn.Sequential(nn.Linear(16, 16)), reduce=3)
    with pytest.raises(TypeError, match=r"^reduce='max' \(str\) is not allowed"):
        Fp8Layers({}, Fp8Recipe(), reduce="max")


def test_from_linear_and_from_conv1d_given_the_wrong_layer():
    with pytest.raises(TypeError, match=r"^linear='x' \(str\) is not allowed: .*torch\.nn\.Linear"):
        Fp8Linear.from_linear("x", Fp8Recipe())
    with pytest.raises(TypeError, match=re.escape("str is not a Conv1D layer")):
        Fp8Conv1D.from_conv1d("x", Fp8Recipe())


def test_fp8_layers_given_no_mapping_of_fp8_layers():
    with pytest.raises(TypeError, match=r"^layers=\[.*\] \(list\) is not allowed: .*mapping"):
        Fp8Layers([nn.Linear(2, 2)], Fp8Recipe())
    with pytest.raises(TypeError, match=r"^layers\['fc'\]=.* \(Linear\) is not allowed: .*Fp8Module"):
        Fp8Layers({"fc": nn.Linear(2, 2)}, Fp8Recipe())
