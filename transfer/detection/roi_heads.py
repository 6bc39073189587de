"""ROI heads the MoCo detection protocol needs on top of detectron2's."""

from __future__ import annotations

from detectron2.layers import get_norm
from detectron2.modeling import ROI_HEADS_REGISTRY
from detectron2.modeling.roi_heads import Res5ROIHeads


@ROI_HEADS_REGISTRY.register()
class Res5ROIHeadsExtraNorm(Res5ROIHeads):
    """C4 box head with one extra normalization layer after res5 (the MoCo paper's "extra BN").

    A torchvision-style backbone has no normalization after its last residual addition, so the
    res5 features fed to the box predictor are unnormalized; the extra layer (of type
    ``MODEL.RESNETS.NORM``, 8 x ``RES2_OUT_CHANNELS`` channels, module name ``roi_heads.res5.norm``)
    gives the new layers normalized inputs. It is new, so converted weights never cover it.
    """

    @classmethod
    def _build_res5_block(cls, cfg):
        res5, out_channels = super()._build_res5_block(cfg)
        res5.add_module("norm", get_norm(cfg.MODEL.RESNETS.NORM, out_channels))
        return res5, out_channels
