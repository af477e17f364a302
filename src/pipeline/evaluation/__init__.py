"""Detection metrics, the one place where they are computed: the per-image records every
matcher reads (`records`), matching and P/R/F1 (`matching`, COCO's or the VOC devkit's rules),
COCO AP as pycocotools computes it, with size buckets (`coco`, its matching on arrays in
`coco_matching`), VOC AP@.5 (`voc`), the intervals over images of F1, precision, recall and
F1's paired change (`image_bootstrap`), AP's (`intervals`, each resample's AP by
`weighted_ap` from the weighted sums of `weighted_sums`) and AP@.5's paired change
(`paired_ap`), image-level F1 (`image_level`) and the evaluation loop (`loop`)."""
