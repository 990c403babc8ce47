// Auxiliary kernels of one dtype (FT_BF16), named FT_KERNEL_PREFIX + _preprocess / _convert_dq / _dropout_mask.
#include "flash_aux.cuh"

#define FT_CONCAT_(a, b) a##b
#define FT_CONCAT(a, b) FT_CONCAT_(a, b)

extern "C" __global__ void __launch_bounds__(flashtrain::kAuxThreads)
    FT_CONCAT(FT_KERNEL_PREFIX, _preprocess)(const __grid_constant__ flashtrain::AuxParams params) {
    flashtrain::bwd_preprocess<FT_BF16>(params);
}
extern "C" __global__ void __launch_bounds__(flashtrain::kAuxThreads)
    FT_CONCAT(FT_KERNEL_PREFIX, _convert_dq)(const __grid_constant__ flashtrain::AuxParams params) {
    flashtrain::bwd_convert_dq<FT_BF16>(params);
}
extern "C" __global__ void __launch_bounds__(flashtrain::kAuxThreads)
    FT_CONCAT(FT_KERNEL_PREFIX, _dropout_mask)(const __grid_constant__ flashtrain::AuxParams params) {
    flashtrain::dropout_mask(params);
}
