"""An example envoy-epp plugin package: `label-preference-scorer`."""

from epp_label_preference.scorer import LabelPreferenceScorer

__all__ = ["LabelPreferenceScorer"]
