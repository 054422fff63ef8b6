// epx/epx.h: the whole public surface.
#pragma once
#include "epx/checkpoint.h"
#include "epx/config.h"
#include "epx/dispatch.h"
#include "epx/dtype.h"
#include "epx/error.h"
#include "epx/experts.h"
#include "epx/group.h"
#include "epx/log.h"
#include "epx/moe.h"
#include "epx/quant.h"
#include "epx/routing.h"
#include "epx/tensor.h"
