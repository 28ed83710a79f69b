// cuBLASLt status checks that become twell::Error, for the files that call cuBLASLt.
#pragma once

#include <cublasLt.h>

#include "twell/error.h"

#define TWELL_CUBLAS_CHECK(expression)                                                              \
  do {                                                                                              \
    cublasStatus_t twell_status_ = (expression);                                                    \
    if (twell_status_ != CUBLAS_STATUS_SUCCESS)                                                     \
      ::twell::fail("cuBLASLt error {} in {} ({}:{})", static_cast<int>(twell_status_), #expression, \
                    __FILE__, __LINE__);                                                            \
  } while (0)
