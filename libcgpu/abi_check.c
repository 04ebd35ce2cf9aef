/*
 * abi_check.c: compile-time checks that include/cuda.h and include/nvml.h
 * keep NVIDIA's layouts and values (64-bit Linux). Built with -fsyntax-only
 * by the Makefile; a drifted header fails the build.
 */
#include <assert.h>
#include <stddef.h>

#include "cuda.h"
#define NVML_NO_UNVERSIONED_FUNCTION_DEFS
#include "nvml.h"

static_assert(sizeof(CUdeviceptr) == 8, "CUdeviceptr");
static_assert(sizeof(CUuuid) == 16, "CUuuid");
static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig");
static_assert(offsetof(CUlaunchConfig, hStream) == 32, "CUlaunchConfig.hStream");
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute");
static_assert(offsetof(CUlaunchAttribute, value) == 8, "CUlaunchAttribute.value");
static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location");
static_assert(sizeof(CUmemPoolProps) == 88, "CUmemPoolProps");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");
static_assert(sizeof(CUDA_ARRAY_DESCRIPTOR) == 24, "CUDA_ARRAY_DESCRIPTOR");
static_assert(sizeof(CUDA_ARRAY3D_DESCRIPTOR) == 40, "CUDA_ARRAY3D_DESCRIPTOR");
static_assert(sizeof(CUexecAffinityParam) == 8, "CUexecAffinityParam");
static_assert(sizeof(CUctxCreateParams) == 24, "CUctxCreateParams");
static_assert(sizeof(CUDA_MEMCPY2D) == 128, "CUDA_MEMCPY2D");
static_assert(offsetof(CUDA_MEMCPY2D, dstXInBytes) == 56, "CUDA_MEMCPY2D.dstXInBytes");
static_assert(sizeof(CUDA_MEMCPY3D) == 200, "CUDA_MEMCPY3D");
static_assert(offsetof(CUDA_MEMCPY3D, dstXInBytes) == 88, "CUDA_MEMCPY3D.dstXInBytes");
static_assert(offsetof(CUDA_MEMCPY3D, WidthInBytes) == 176, "CUDA_MEMCPY3D.WidthInBytes");
static_assert(sizeof(CUDA_MEMCPY3D_PEER) == 200, "CUDA_MEMCPY3D_PEER");
static_assert(offsetof(CUDA_MEMCPY3D_PEER, dstContext) == 152, "CUDA_MEMCPY3D_PEER.dstContext");
static_assert(sizeof(CUDA_LAUNCH_PARAMS) == 56, "CUDA_LAUNCH_PARAMS");
static_assert(offsetof(CUDA_LAUNCH_PARAMS, hStream) == 40, "CUDA_LAUNCH_PARAMS.hStream");
static_assert(CU_MEMORYTYPE_DEVICE == 2 && CU_MEMORYTYPE_UNIFIED == 4, "CUmemorytype");
static_assert(CUDA_ERROR_OUT_OF_MEMORY == 2 && CUDA_ERROR_NOT_FOUND == 500 &&
              CUDA_ERROR_NOT_READY == 600 && CUDA_ERROR_UNKNOWN == 999, "CUresult");
static_assert(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT == 16 &&
              CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR == 39 &&
              CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED == 115, "CUdevice_attribute");
static_assert(CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM == 2, "proc address flags");
static_assert(CU_LAUNCH_ATTRIBUTE_COOPERATIVE == 2, "CUlaunchAttributeID");

static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t");
static_assert(sizeof(nvmlProcessInfo_v2_t) == 24, "nvmlProcessInfo_v2_t");
static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t");
static_assert(offsetof(nvmlProcessInfo_t, gpuInstanceId) == 16, "nvmlProcessInfo_t.gi");
static_assert(sizeof(nvmlProcessUtilizationSample_t) == 32, "nvmlProcessUtilizationSample_t");
static_assert(sizeof(nvmlMemory_t) == 24, "nvmlMemory_t");
static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t");
static_assert(nvmlMemory_v2 == 0x02000028, "nvmlMemory_v2");
static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t");
static_assert(sizeof(nvmlUtilization_t) == 8, "nvmlUtilization_t");
static_assert(NVML_ERROR_INSUFFICIENT_SIZE == 7 && NVML_ERROR_NOT_FOUND == 6 &&
              NVML_ERROR_ARGUMENT_VERSION_MISMATCH == 25 && NVML_ERROR_UNKNOWN == 999,
              "nvmlReturn_t");
