"""What a config checks of each kind (``lapse.models.kinds``, imported without torch) is what
the kind's layer class says of itself."""

from dataclasses import fields

import pytest

from lapse.models import ATTENTION_KINDS, ModelConfig
from lapse.models.kinds import ATTENTION_TRAITS, AttentionTraits


@pytest.mark.parametrize("kind", sorted(ATTENTION_KINDS))
def test_traits_are_the_layer_classes_attributes(kind):
    layer = ATTENTION_KINDS[kind]
    said = AttentionTraits(**{f.name: getattr(layer, f.name, f.default) for f in fields(AttentionTraits)})
    assert ATTENTION_TRAITS[kind] == said


def test_an_unknown_kind_names_the_kinds():
    with pytest.raises(ValueError, match="unknown attention kind 'mamba'; valid kinds: softmax, forgetting"):
        ModelConfig(attention="mamba")
