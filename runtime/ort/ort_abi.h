/* The part of onnxruntime's C API that ortspec's custom ops use, without onnxruntime's header.
 *
 * The OrtApi function table that OrtGetApiBase hands a custom-op library is append-only: a
 * function keeps its slot in every later release. The slots below were counted from the public
 * onnxruntime_c_api.h (GetBuildInfoString, slot 254, is checked against the library's answer in
 * the tests). OrtCustomOp is laid out member for member as the C API declares it. */
#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

typedef void OrtStatus;
typedef struct OrtApiBase {
    const void *(*GetApi)(uint32_t version);
    const char *(*GetVersionString)(void);
} OrtApiBase;

enum {  /* slots of the OrtApi function table */
    API_CreateStatus = 0, API_CreateCustomOpDomain = 26, API_CustomOpDomain_Add = 27,
    API_AddCustomOpDomain = 28, API_GetTensorMutableData = 51, API_GetDimensionsCount = 61,
    API_GetDimensions = 62, API_GetTensorTypeAndShape = 65, API_KernelInfoGetAttribute_float = 85,
    API_KernelInfoGetAttribute_int64 = 86, API_KernelContext_GetInput = 90,
    API_KernelContext_GetOutput = 91, API_ReleaseStatus = 93,
    API_ReleaseTensorTypeAndShapeInfo = 99, API_KernelInfoGetConstantInput_tensor = 249,
    API_KernelContext_ParallelFor = 274,
};
#define API_VERSION 16 /* the first with KernelContext_ParallelFor */

static const void *const *api;
#define FN(slot, type) ((type)api[slot])

typedef OrtStatus *(*create_status_t)(int, const char *);
typedef void (*release_t)(void *);
typedef OrtStatus *(*get_input_t)(const void *, size_t, const void **);
typedef OrtStatus *(*get_output_t)(void *, size_t, const int64_t *, size_t, void **);
typedef OrtStatus *(*type_shape_t)(const void *, void **);
typedef OrtStatus *(*dims_count_t)(const void *, size_t *);
typedef OrtStatus *(*dims_t)(const void *, int64_t *, size_t);
typedef OrtStatus *(*mutable_data_t)(void *, void **);
typedef OrtStatus *(*parallel_for_t)(const void *, void (*)(void *, size_t), size_t, size_t, void *);
typedef OrtStatus *(*attr_int_t)(const void *, const char *, int64_t *);
typedef OrtStatus *(*attr_float_t)(const void *, const char *, float *);
typedef OrtStatus *(*constant_input_t)(const void *, size_t, int *, const void **);
typedef OrtStatus *(*create_domain_t)(const char *, void **);
typedef OrtStatus *(*domain_add_t)(void *, const void *);
typedef OrtStatus *(*add_domain_t)(void *, void *);

/* 1 (and the status released) where a call failed */
static int failed(OrtStatus *status) {
    if (!status) return 0;
    FN(API_ReleaseStatus, release_t)(status);
    return 1;
}

static void *data_of(const void *value) {
    void *p = NULL;
    return failed(FN(API_GetTensorMutableData, mutable_data_t)((void *)value, &p)) ? NULL : p;
}

/* dims [up to 8] and rank of a tensor value; -1 where they cannot be read */
static int shape_of(const void *value, int64_t *dims, size_t *rank) {
    void *info;
    if (failed(FN(API_GetTensorTypeAndShape, type_shape_t)(value, &info))) return -1;
    int bad = failed(FN(API_GetDimensionsCount, dims_count_t)(info, rank)) || *rank > 8 ||
              failed(FN(API_GetDimensions, dims_t)(info, dims, *rank));
    FN(API_ReleaseTensorTypeAndShapeInfo, release_t)(info);
    return bad ? -1 : 0;
}

/* input i of a kernel's context: its data alone (no shape is read: a weight the exporter sized),
 * NULL where it cannot be read or the tensor is empty */
static void *data_input(void *context, size_t i) {
    const void *value;
    if (failed(FN(API_KernelContext_GetInput, get_input_t)(context, i, &value)) || !value)
        return NULL;
    return data_of(value);
}

/* input i of a kernel's context: its data, NULL where it cannot be read or the tensor is empty;
 * dims and rank are filled wherever the shape can be read (rank stays as passed otherwise) */
static void *input_of(void *context, size_t i, int64_t *dims, size_t *rank) {
    const void *value;
    if (failed(FN(API_KernelContext_GetInput, get_input_t)(context, i, &value)) || !value ||
        shape_of(value, dims, rank))
        return NULL;
    return data_of(value);
}

/* OrtCustomOp: every member onnxruntime may read, in the C API's order. Kernels are made
 * through CreateKernelV2 (create_checked: an error rather than a NULL kernel) and run through
 * the V1 KernelCompute; shape inference is NULL, so outputs are sized at run time. */
typedef struct {
    uint32_t version;
    void *(*CreateKernel)(const void *, const void *, const void *);
    const char *(*GetName)(const void *);
    const char *(*GetExecutionProviderType)(const void *);
    int (*GetInputType)(const void *, size_t);
    size_t (*GetInputTypeCount)(const void *);
    int (*GetOutputType)(const void *, size_t);
    size_t (*GetOutputTypeCount)(const void *);
    void (*KernelCompute)(void *, void *);
    void (*KernelDestroy)(void *);
    int (*GetInputCharacteristic)(const void *, size_t);
    int (*GetOutputCharacteristic)(const void *, size_t);
    int (*GetInputMemoryType)(const void *, size_t);
    int (*GetVariadicInputMinArity)(const void *);
    int (*GetVariadicInputHomogeneity)(const void *);
    int (*GetVariadicOutputMinArity)(const void *);
    int (*GetVariadicOutputHomogeneity)(const void *);
    OrtStatus *(*CreateKernelV2)(const void *, const void *, const void *, void **);
    void *KernelComputeV2;
    void *InferOutputShapeFn;
    int (*GetStartVersion)(const void *);
    int (*GetEndVersion)(const void *);
    size_t (*GetMayInplace)(int **, int **);
    void (*ReleaseMayInplace)(int *, int *);
    size_t (*GetAliasMap)(int **, int **);
    void (*ReleaseAliasMap)(int *, int *);
    void *unused[16];  /* zeroed room for members of later versions */
} CustomOp;

/* the ONNX element types the ops declare: 1 float, 2 uint8, 7 int64, 10 float16 */
enum { ELEM_FLOAT = 1, ELEM_UINT8 = 2, ELEM_INT64 = 7, ELEM_FLOAT16 = 10 };

static const char *cpu(const void *op) { (void)op; return "CPUExecutionProvider"; }
static int output_type(const void *op, size_t i) { (void)op; (void)i; return ELEM_FLOAT; }
static size_t one_output(const void *op) { (void)op; return 1; }
static int required(const void *op, size_t i) { (void)op; (void)i; return 0; }
static int default_memory(const void *op, size_t i) { (void)op; (void)i; return 0; }
static int one(const void *op) { (void)op; return 1; }
static int first_version(const void *op) { (void)op; return 1; }
static int last_version(const void *op) { (void)op; return 0x7fffffff; }
static size_t no_pairs(int **a, int **b) { *a = NULL; *b = NULL; return 0; }
static void release_pairs(int *a, int *b) { (void)a; (void)b; }

/* CreateKernelV2 of every op: the op's own create, and where that refused the node, an error
 * naming the op (onnxruntime would run a NULL kernel) */
static OrtStatus *create_checked(const void *op, const void *table, const void *info,
                                 void **kernel) {
    const CustomOp *custom = op;
    *kernel = custom->CreateKernel(op, table, info);
    if (*kernel) return NULL;
    char message[320];
    snprintf(message, sizeof message,
             "ortspec.%s: the node's attributes are missing or out of range, or memory ran out "
             "(the products need K and N, with N a multiple of 16 and K of 32, and the ...Norm "
             "ones epsilon; the attentions num_heads > 0 and scale, and RotaryCacheAttention an "
             "even rotary_dim > 0)", custom->GetName(op));
    return FN(API_CreateStatus, create_status_t)(2, message);  /* ORT_INVALID_ARGUMENT */
}

/* an op of `outputs` outputs of the types out_type gives, run on the CPU, every input required */
#define CUSTOM_OP_TYPED(create, name, input_type, inputs, out_type, outputs, compute, destroy) \
    {API_VERSION, create, name, cpu, input_type, inputs, out_type, outputs,                 \
     compute, destroy, required, required, default_memory, one, one, one, one,              \
     create_checked, NULL, NULL, first_version, last_version, no_pairs, release_pairs,      \
     no_pairs, release_pairs, {0}}
/* ... of float outputs */
#define CUSTOM_OP_N(create, name, input_type, inputs, outputs, compute, destroy) \
    CUSTOM_OP_TYPED(create, name, input_type, inputs, output_type, outputs, compute, destroy)
#define CUSTOM_OP(create, name, input_type, inputs, compute, destroy) \
    CUSTOM_OP_N(create, name, input_type, inputs, one_output, compute, destroy)
