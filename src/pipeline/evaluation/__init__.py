"""Detection metrics, the one place where they are computed: matching and P/R/F1
(`matching`, COCO's or the VOC devkit's rules), COCO AP through pycocotools with size buckets
(`coco`), VOC AP@.5 (`voc`), AP's intervals over images (`intervals`), image-level F1
(`image_level`) and the evaluation loop (`loop`)."""
