// DTRAIN_API marks the public API of libdtrain. A shared libdtrain is built with hidden symbols by
// default (-fvisibility=hidden), so only what carries DTRAIN_API (classes, so that their vtables
// and type_info cross the library boundary, and free functions) is exported; everything else stays
// private to the library. In a static build the attribute changes nothing.
#pragma once

#if defined(_WIN32)
#if defined(DTRAIN_SHARED) && defined(DTRAIN_BUILDING_LIBRARY)
#define DTRAIN_API __declspec(dllexport)
#elif defined(DTRAIN_SHARED)
#define DTRAIN_API __declspec(dllimport)
#else
#define DTRAIN_API
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define DTRAIN_API __attribute__((visibility("default")))
#else
#define DTRAIN_API
#endif
