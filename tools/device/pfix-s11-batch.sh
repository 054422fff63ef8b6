#!/usr/bin/env bash
# tools/device/pfix-s11-batch.sh (copy as .carry-pfix/batch.sh): the lead's check of the lean consumer's predicated
# look-ahead loads (lean_load_if: after an item's last K block nothing is loaded, where a8ccbfa reloaded the just-released
# stage); epx-gemm-bench-old of a8ccbfa. The steps: tools/device/prefill-check-s11.sh.
NAME=pfix LAST=rows exec bash tools/device/prefill-check-s11.sh
